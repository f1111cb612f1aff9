"""Describe a model for the cost model: its units, then per unit what it stores and how long it computes,
measured on the device (``describe.measured``) or estimated from a fake-tensor trace (``describe.analytic``)."""
