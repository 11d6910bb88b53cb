"""The package whole: its public face and module graph, the programs users
copy (examples, notebooks, a long scenario), many devices and many
processes."""
