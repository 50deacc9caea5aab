package testutil

import (
	"bytes"
	"fmt"
	"os"
	"syscall"
	"testing"
)

// Stop sends SIGSTOP to process pid and waits until every one of its
// threads is stopped (a signal's delivery is asynchronous). Stopped
// processes are continued (SIGCONT) when the test ends.
func Stop(t testing.TB, pid int) {
	t.Helper()
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGCONT) })
	Eventually(t, Wait, func() error {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		if err != nil {
			t.Fatal(err)
		}
		stopped := 0
		for _, task := range tasks {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, task.Name()))
			if err != nil {
				continue
			}
			// The state follows the command name in parentheses.
			if i := bytes.LastIndexByte(b, ')'); i >= 0 && i+2 < len(b) && b[i+2] == 'T' {
				stopped++
			}
		}
		if stopped != len(tasks) {
			return fmt.Errorf("%d of the %d threads of process %d stopped", stopped, len(tasks), pid)
		}
		return nil
	})
}
