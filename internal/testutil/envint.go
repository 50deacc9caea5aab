package testutil

import (
	"os"
	"strconv"
	"testing"
)

// PositiveEnv returns the positive integer in the environment variable
// name, or def where it is unset; anything else fails the test.
func PositiveEnv(t testing.TB, name string, def int64) int64 {
	t.Helper()
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil || v <= 0 {
		t.Fatalf("%s=%q: want a positive integer", name, s)
	}
	return v
}
