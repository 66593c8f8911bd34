"""Framework adapters (``torch``, ``tensorflow``) and their backend strategies.

Installed as ``polytrain.adapters``; each subpackage imports its framework itself.
"""
