// Package dl is what the raw layers over native libraries (internal/cu,
// internal/ucx) share about loading theirs: which path is loaded (set by
// the program, else an environment variable, else a versioned soname),
// and loading it once. The loading itself (dlopen, symbols) stays in those
// packages, the only ones that use purego or unsafe.
package dl

import (
	"errors"
	"os"
	"strings"
	"sync"
)

// Library is a native library loaded at run time, at most once. The zero
// value is not usable: Default and Env must be set.
type Library struct {
	Pkg     string // the package loading it, which errors name ("cu")
	Name    string // what errors call the library ("the driver library")
	Default string // the versioned soname loaded by default
	Env     string // the environment variable that overrides Default

	once   sync.Once
	err    error
	mu     sync.Mutex
	path   string // set by Set
	loaded string // the path Load chose
}

// Set sets the path to load. It must be called before Load; afterwards it
// returns an error.
func (l *Library) Set(path string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.loaded != "" {
		return errors.New(l.Pkg + ": " + l.Name + " is already loaded from " + l.loaded)
	}
	l.path = path
	return nil
}

// Path returns the path that is (or will be) loaded.
func (l *Library) Path() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.loaded != "" {
		return l.loaded
	}
	return l.chosen()
}

func (l *Library) chosen() string {
	if l.path != "" {
		return l.path
	}
	if p := os.Getenv(l.Env); p != "" {
		return p
	}
	return l.Default
}

// Load calls open with the chosen path, once; later calls return the
// first result.
func (l *Library) Load(open func(path string) error) error {
	l.once.Do(func() {
		l.mu.Lock()
		path := l.chosen()
		l.loaded = path
		l.mu.Unlock()
		l.err = open(path)
	})
	return l.err
}

// OpenReason is why dlopen failed, from its error: dlerror's text, or,
// where that is lost (purego over cgo's dlopen can lose it), a reason that
// says what to check.
func OpenReason(err error) string {
	if reason := strings.TrimSpace(err.Error()); reason != "" {
		return reason
	}
	return "the dynamic loader cannot open it (not installed, or not on the library path)"
}
