"""The machinery every role and the pipeline share: rank agreement, collectives, tree walks,
digests, events, the build environment and its report. Nothing here imports a
materializer, a synchronizer, a backend or the pipeline."""
