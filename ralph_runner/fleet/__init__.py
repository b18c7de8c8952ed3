"""Many hosts: the fleet run, fleet status, the Prometheus textfile, notifications."""
