"""Prompt datasets in verl's parquet schema: one row's fields (rows), reading and preparing
datasets and the task registry (prompts), and the GSM8K preparation (gsm8k). A run's files are
checked before it starts by `asyncrl.launch.data_check`."""
