"""The one request path every door shares: the door-neutral ``Request`` and its validation, input
processing (template, tokenize), the stream's life from hooks through the engine to its one ending
(``lifecycle``), writing engine outputs to the doors (``outputs``), registered prompts."""
