"""actors: a small trio actor toolkit with single-owner state, backpressure and supervision."""
