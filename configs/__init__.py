"""jssl's recipes: ``base`` (the defaults), ``recipes`` (shared pieces) and one config per method
or engine. Installed with jssl, so that a config file anywhere can ``from configs import base``."""
