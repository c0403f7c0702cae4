"""Run state on disk: the orbax checkpoint manager (``manager``: save, resume), what makes a
checkpoint damaged rather than unreadable for now (``integrity``: its files read back), weight
import from jssl workdirs and PyTorch files (``weights``), warm starts (``warm_start``), the
evaluated run's model fields (``source_model``) and the workdir's rules (``workdir``: lock,
config.json)."""
