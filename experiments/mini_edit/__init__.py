"""The mini edit proof (experiments/mini_edit/run.sh): sign-edit data and its pretraining feed."""
