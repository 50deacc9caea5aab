//go:build !race

package testutil

// RaceEnabled reports whether the binary was built with -race, whose
// shadow memory multiplies a process's resident set several times over:
// tests that bound memory scale their bound by it.
const RaceEnabled = false
