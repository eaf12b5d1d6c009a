"""Layer ``simulation``: counterfactual ``traces`` recorded by driving the engine with forced arms, and the
offline regret simulator ``simulate`` (synthetic or replayed bandit instances). Imports the layers up to ``engine``."""
