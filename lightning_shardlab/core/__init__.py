"""The foundations every layer above may use: the options, checked once, and how numbers are shown.

config.py   ``ShardLabConfig`` (the strategy's options, validated and frozen), ``Stage``, ``Accumulation``,
            the precision policy, and the checks every public class's options go through
display.py  sizes and rich tables for every report
"""
