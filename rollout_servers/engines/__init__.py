"""Inference engines behind one small interface (`base.Engine`): `hf` (transformers, CPU or
CUDA, in-process) and `vllm` (vLLM's AsyncLLM, whose worker process joins the weight-sync group
through the extension in `vllm_worker`)."""
