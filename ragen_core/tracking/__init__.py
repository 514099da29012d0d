"""MLflow: the tracker of a training run (batched, resumable, offline-tolerant logging), episodes as
traces, the transcripts page and the paper-style plots. Only this package and the run's logging modules
(``ragen_core.run``) reach MLflow.

Import names from the module that defines them; this package re-exports nothing.
"""
