"""verify.py's parts: the report (rows, tolerances, adapters' calls), the replay of a dump's updates, and the
adapters for other implementations (adapters/)."""
