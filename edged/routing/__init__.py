"""The path decision (pure): conditions, estimates and ``decide()``. Import the modules
(``edged.routing.decide``...): this package loads nothing, so that a module that needs one of
them (cloudsync needs ``abtest``) loads only that one."""
