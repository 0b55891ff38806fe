"""The training job: placement, rank tables, launch environment, state and the reconcile loop."""
