"""The driver's shell: the decision loop that feeds the core what happened and performs
what it decides, the job's life cycle (services up, hand-over, shutdown), its result, and
``launch(config)``, which wires the parts for one job."""
