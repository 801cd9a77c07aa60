"""Explaining a failure: the NaN replay and its recorder, parameter snapshots, the sanity pre-flight, the
crash finding's text, loss landscapes.
"""
