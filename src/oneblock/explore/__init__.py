"""``oneblock explore``: a local web page that opens a real model on your own text.

The figures are computed by ``analysis`` (one forward pass: attention, residual stream, logit lens, next token)
and ``card`` (config, parameters, checks); ``server`` serves them as JSON beside the hand-written page in
``static/``; ``page`` writes the same page as one self-contained HTML file.
"""

from oneblock.explore.loading import Codec, Explorable, load_explore_model
from oneblock.explore.requests import Limits

__all__ = ["Codec", "Explorable", "Limits", "load_explore_model"]
