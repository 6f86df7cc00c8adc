"""Head formats: one module per format, each holding one `edged.heads.base.Head` subclass.

`edged.heads.registry` lists them (`HEADS`) and tells which one a model's output is; adding a
format means writing its module, adding its class there and its name to `edged.config.HeadName`.
"""
