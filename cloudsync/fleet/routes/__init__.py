"""The fleet API's routes, one module per resource (nodes, commands, deployments, rollouts, A/B
tests, enrolment, audit, and the public ones), each a class constructed by the composition root
(``cloudsync.fleet.daemon.application``) with only the repositories and the publishing calls it
uses, and each giving its route table (``routes()``) to ``cloudsync.fleet.api.app``. Loads
nothing."""
