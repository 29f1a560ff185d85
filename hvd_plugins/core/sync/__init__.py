"""POLICY: the sync modes, one module or package each, on the mechanism of ``core.comm``.

``base`` (what every mode offers and owns), ``flat`` (Horovod's optimizer), ``hierarchical`` (the
two-level legs and their route tuner), ``daso`` (its schedule and cross-node parameter sync),
``guards`` (the watchdog and finite check around every sync), ``table`` (config -> mode).
"""
