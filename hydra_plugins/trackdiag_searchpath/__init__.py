"""Makes trackdiag's ``diag`` config group visible to every Hydra app (``+diag=advanced``).

Hydra imports this module at every app start: keep it trivial.
"""
from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class TrackdiagSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="trackdiag", path="pkg://trackdiag.conf")
