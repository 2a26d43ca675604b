"""`make bench`: Scorebox against the model-bound limit C/L and a Celery baseline.

Modules: `run` (command line and scenarios), `infra` (broker, database, fake model, vhosts,
machine facts), `procstat` (CPU and memory from /proc), `load` (HTTP load and completion
events), `stats` (percentiles and rates), `celery_app` + `celery_baseline` (the baseline),
`report` (renders the latest results into README.md).
"""
