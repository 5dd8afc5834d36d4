"""Vital signs: per-rank curves that overlap on a healthy run, and a dashboard that draws them.

callback.py       ``ShardLabVitals``: loss, per-unit gradient norms and update ratios, activations
dashboard.py      the HTML dashboard (one panel per signal, ranks overlaid)
option_curves.py  the error each fewer-bytes option brings, per unit, as curves (only where one is on)
"""
