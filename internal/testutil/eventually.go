package testutil

import (
	"testing"
	"time"
)

// Eventually calls cond until it returns nil, and fails the test with
// cond's last error when timeout passes first: a test that waits for
// something asynchronous (the daemon noticing a closed connection, a
// listener coming up) fails instead of hanging until go test's own
// timeout. cond runs on the test's goroutine, so it may call t.Fatal.
// The interval between calls grows from 1 ms to 20 ms; it orders nothing.
func Eventually(t testing.TB, timeout time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	pause := time.Millisecond
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not within %v: %v", timeout, err)
		}
		time.Sleep(pause)
		pause = min(2*pause, 20*time.Millisecond)
	}
}

// Wait is the timeout tests give Eventually for what takes milliseconds on
// an idle machine: long enough for a loaded 2-core machine under -race,
// short enough that a failure ends the test well before go test's timeout.
const Wait = 30 * time.Second

// Next returns the next value from ch, and fails the test when none comes
// within timeout or ch is closed.
func Next[T any](t testing.TB, ch <-chan T, timeout time.Duration) T {
	t.Helper()
	select {
	case v, ok := <-ch:
		if !ok {
			t.Fatalf("the channel closed while the test waited for a %T", v)
		}
		return v
	case <-time.After(timeout):
		var zero T
		t.Fatalf("no %T within %v", zero, timeout)
		return zero
	}
}

// WaitFor receives from ch until a value matches, and returns it; it fails
// the test when none matches within timeout or ch closes first.
func WaitFor[T any](t testing.TB, ch <-chan T, timeout time.Duration, match func(T) bool) T {
	t.Helper()
	deadline := time.After(timeout)
	var seen []T
	for {
		select {
		case v, ok := <-ch:
			if !ok {
				t.Fatalf("the channel closed before a match; received %v", seen)
			}
			if match(v) {
				return v
			}
			if len(seen) < 20 {
				seen = append(seen, v)
			}
		case <-deadline:
			t.Fatalf("no match within %v; received %v", timeout, seen)
		}
	}
}

// Drain receives from ch until it is closed, and fails the test when it is
// still open after timeout.
func Drain[T any](t testing.TB, ch <-chan T, timeout time.Duration) {
	t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case _, ok := <-ch:
			if !ok {
				return
			}
		case <-deadline:
			t.Fatalf("the channel is still open after %v", timeout)
		}
	}
}
