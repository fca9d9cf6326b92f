"""Pipeline parallelism: schedules as data, stage partitioning, one executor, PipeDream-2BW,
TeraPipe and timelines (docs/pipeline.md)."""
