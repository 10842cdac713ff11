"""The backends behind ``zerolayer.engine.backend.Backend``: ``cpu`` (our decoder on torch),
``neuron`` (transformers-neuronx), ``synthetic`` (no model); ``factory`` picks one from the
config."""
