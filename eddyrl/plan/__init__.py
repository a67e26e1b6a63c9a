"""Memory plans: what a run will hold on each device, predicted from the model's shape and the
run's settings before anything starts (`eddy plan`, and `eddy train`'s preflight)."""
