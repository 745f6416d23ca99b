"""Analysis of runs, outside the core.

- `plot` (with `figures` and `timeline`): `asyncrl plot RUN_DIR`, PNG figures of metrics.jsonl
  and a Gantt chart and Chrome trace of the processes' spans.
- `pipeline_model`: a discrete-event model of the pipeline that `tools/simulate.py` drives; it
  runs the replay's own `AdmissionController`. Its inputs are `pipeline_inputs` (a `Fleet`: a
  run's `Config` plus the response lengths; the unit `Costs`), which `pipeline_calibration`
  fits to `tools/bench_pipeline.py` records.
"""
