package dl

import (
	"errors"
	"strings"
	"testing"
)

func TestPathChoiceAndLoadOnce(t *testing.T) {
	const env = "CUDAIPC_DL_TEST_LIB"
	l := &Library{Pkg: "test", Name: "the test library", Default: "libtest.so.1", Env: env}
	t.Setenv(env, "")
	if got := l.Path(); got != "libtest.so.1" {
		t.Fatalf("Path() = %q, want the default", got)
	}
	t.Setenv(env, "/from/env.so")
	if got := l.Path(); got != "/from/env.so" {
		t.Fatalf("Path() = %q, want the environment's", got)
	}
	if err := l.Set("/from/set.so"); err != nil {
		t.Fatal(err)
	}
	if got := l.Path(); got != "/from/set.so" {
		t.Fatalf("Path() = %q, want the one Set gave", got)
	}
	failed := errors.New("open failed")
	var opened []string
	open := func(path string) error { opened = append(opened, path); return failed }
	for range 3 {
		if err := l.Load(open); err != failed {
			t.Fatalf("Load() = %v, want the first open's error", err)
		}
	}
	if len(opened) != 1 || opened[0] != "/from/set.so" {
		t.Fatalf("open called with %q, want once with the path Set gave", opened)
	}
	err := l.Set("/too/late.so")
	if err == nil || !strings.Contains(err.Error(), "test: the test library is already loaded from /from/set.so") {
		t.Fatalf("Set after Load: %v", err)
	}
	t.Setenv(env, "/other/env.so")
	if got := l.Path(); got != "/from/set.so" {
		t.Fatalf("Path() after Load = %q, want the loaded one", got)
	}
}

func TestOpenReason(t *testing.T) {
	if got := OpenReason(errors.New(" libx.so: cannot open shared object file \n")); got != "libx.so: cannot open shared object file" {
		t.Fatalf("OpenReason kept dlerror's text as %q", got)
	}
	if got := OpenReason(errors.New("  ")); !strings.Contains(got, "not on the library path") {
		t.Fatalf("OpenReason of an empty error = %q", got)
	}
}
