"""The explorer's interactive side: open one tensor of a stored result (drill-down), overlay an
update on the Fisher it was scored against, and compare two results. Numbers are computed on
demand from the stored safetensors artifacts, one tensor at a time, and cached as JSON in the
artifact store (app/explore/cache.py), as the share figures are."""
