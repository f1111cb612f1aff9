"""The plain data that crosses every boundary: the ``Plan`` (``schema.plan``) and the ``ModelDescription``
(``schema.description``). No torch here: the search reads both, the planner writes them, ``osdp.wrap`` applies
the one and the cost model prices the other."""
