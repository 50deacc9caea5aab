package testutil

import (
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"
)

// fatalRecorder stands for a test: Fatalf records its message and ends the
// goroutine, as testing.T's does.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (f *fatalRecorder) Helper() {}

func (f *fatalRecorder) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func runEventually(timeout time.Duration, cond func() error) (msg string, elapsed time.Duration) {
	f := &fatalRecorder{}
	done := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(done)
		Eventually(f, timeout, cond)
	}()
	<-done
	return f.msg, time.Since(start)
}

func TestEventuallyReturnsOnceCondHolds(t *testing.T) {
	calls := 0
	msg, _ := runEventually(Wait, func() error {
		calls++
		if calls < 5 {
			return fmt.Errorf("call %d", calls)
		}
		return nil
	})
	if msg != "" || calls != 5 {
		t.Fatalf("failed with %q after %d calls, want success on the 5th", msg, calls)
	}
}

func TestEventuallyFailsWithTheLastError(t *testing.T) {
	calls := 0
	msg, elapsed := runEventually(50*time.Millisecond, func() error {
		calls++
		return fmt.Errorf("still %d", calls)
	})
	if !strings.HasPrefix(msg, "not within 50ms: still ") || !strings.HasSuffix(msg, fmt.Sprint(calls)) {
		t.Fatalf("message %q after %d calls", msg, calls)
	}
	if elapsed < 50*time.Millisecond {
		t.Fatalf("gave up after %v, before its timeout", elapsed)
	}
}
