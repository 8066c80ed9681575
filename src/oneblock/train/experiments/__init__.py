"""Experiments that measure the lesson's claims: ``residuals`` (gradient flow with and without skips) and
``norm_placement`` (pre-LN against post-LN); run them with ``oneblock experiment``."""
