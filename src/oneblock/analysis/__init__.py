"""Looking inside a model: exact parameter and FLOP counts, sanity checks, shape traces and plots."""
