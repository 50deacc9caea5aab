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

func TestNextAndWaitFor(t *testing.T) {
	ch := make(chan int, 4)
	ch <- 1
	ch <- 2
	ch <- 3
	if v := Next(t, ch, Wait); v != 1 {
		t.Fatalf("Next = %d, want 1", v)
	}
	if v := WaitFor(t, ch, Wait, func(v int) bool { return v == 3 }); v != 3 {
		t.Fatalf("WaitFor = %d, want 3", v)
	}
	f := &fatalRecorder{}
	done := make(chan struct{})
	go func() { defer close(done); Next(f, ch, 20*time.Millisecond) }()
	<-done
	if !strings.HasPrefix(f.msg, "no int within 20ms") {
		t.Fatalf("Next on an empty channel: %q", f.msg)
	}
	open := make(chan int, 1)
	open <- 1
	f = &fatalRecorder{}
	done = make(chan struct{})
	go func() { defer close(done); Drain(f, open, 20*time.Millisecond) }()
	<-done
	if !strings.HasPrefix(f.msg, "the channel is still open after 20ms") {
		t.Fatalf("Drain of an open channel: %q", f.msg)
	}
	ch <- 4
	close(ch)
	f = &fatalRecorder{}
	done = make(chan struct{})
	go func() { defer close(done); WaitFor(f, ch, Wait, func(v int) bool { return v == 5 }) }()
	<-done
	if !strings.Contains(f.msg, "closed before a match; received [4]") {
		t.Fatalf("WaitFor on a closed channel: %q", f.msg)
	}
}
