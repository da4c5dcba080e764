"""`gpuwatch service`: put gpuwatch on a node as a systemd service from an installed wheel, take it off again,
and hand out the monitoring assets (alert rules, Alertmanager example, Grafana dashboard, runbook).

Everything comes from the wheel's `share/gpuwatch/` (hatch shared-data), so a node needs no checkout:

* layout.py   what goes where: the node's files (one entry each; a new unit is one more entry) and the assets
* install.py  install and uninstall, with a manifest so that uninstall undoes exactly what install did
* assets.py   the monitoring assets copied for the Prometheus and Grafana host, runbook links pointed home
* cli.py      the commands

docs/service.md is the user's page.
"""
