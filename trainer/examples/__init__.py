"""Example jobs; `mlp` is the built-in one and the template for a user's own job."""
