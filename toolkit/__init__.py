"""toolkit: builds artifacts (datasets, drafters, heads, predictors) for the decode runtime."""
