"""What needs no Lightning: Horovod's backend, how bytes move (``comm``), DASO, settings and fault handling.

Layers, lowest first: ``backend`` (the only code that knows Horovod's internals) < ``comm`` < ``daso``
< the rest. The faces (``hvd_plugins.pytorch``, ``hvd_plugins.fabric``) sit above.
"""
