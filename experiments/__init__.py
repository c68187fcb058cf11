"""Experiments run from the checkout (not installed with the packages): each folder one experiment's command lines
and the analysis code its tests import."""
