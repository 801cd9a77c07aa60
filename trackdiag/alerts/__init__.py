"""What the rules' findings mean: the alert book (one incident, one alert), non-finite incidents, the task and
objective a loss is judged against. (The severities themselves: :mod:`trackdiag.core.policy`.)
"""
