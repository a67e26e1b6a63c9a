"""Model builders. `tiny` is the default policy that `eddy train` runs with no arguments."""
