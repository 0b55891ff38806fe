"""trainerd for MindFormers jobs (`run_mindformer.py` with a YAML config).

- `launch`: the job's entrypoint. It writes each generation's YAML from the user's (`generation_config`: the
  world-size-dependent values, Checkpoint 2.0 into TRAINERD_CHECKPOINT_DIR, MindFormers' own resume settings)
  and execs MindFormers' runner with it.
- `callback`: the MindFormers callback `launch` adds to that YAML. It reports steps, loss and global norm,
  MindFormers' skipped steps as bad batches, and each checkpoint MindFormers commits.
- `checkpoint_tracker`: Checkpoint 2.0's commit point, `latest_checkpointed_iteration.txt`.

Only `callback` imports MindFormers; the rest is plain Python.
"""
