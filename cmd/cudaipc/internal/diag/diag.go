// Package diag holds the command line's diagnostics: the doctor's checks,
// the demo and the benchmarks (bench ipc, bench store). The CLI (package
// cli) parses their flags into the exported command types and calls Run
// with an Env; everything else about them lives here, out of the way of
// the commands that run and use the store.
//
// # Helper processes
//
// The doctor's IPC self-test, bench ipc and the demo need a second and
// third process. They re-execute this program with one hidden command,
//
//	cudaipc diag-helper ROLE CONFIG
//
// where ROLE names the helper (doctor-exporter, bench-exporter,
// demo-worker) and CONFIG is its configuration as JSON. The CLI routes
// that command to RunHelper; a test binary that runs diagnostics routes it
// from its TestMain. The helper and its parent then talk over the helper's
// standard input and output, one JSON value a line.
package diag

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/cudaipc/cudaipc/client"
)

// Env is what a diagnostic runs with: the CLI's context, writers, logger and
// global flags.
type Env struct {
	Ctx    context.Context // cancelled on SIGINT or SIGTERM
	Stdin  io.Reader
	Stdout io.Writer
	Stderr io.Writer
	Log    *slog.Logger
	// LogLevel is the --log-level Log was made with.
	LogLevel string
	// Socket is the store daemon's socket as the user named it (--socket or
	// $CUDAIPC_SOCKET), or "" when they did not; DefaultSocket is where the
	// CLI looks then.
	Socket, DefaultSocket string
	// Explain rewords an error of the client package so that it says what
	// to do next (the CLI's wording); nil leaves errors as they are.
	Explain func(err error, socket string) error
}

// socket is the daemon socket the user means: Socket, else DefaultSocket.
func (e *Env) socket() string {
	if e.Socket != "" {
		return e.Socket
	}
	return e.DefaultSocket
}

// explain rewords err with Explain.
func (e *Env) explain(err error, socket string) error {
	if err == nil || e.Explain == nil {
		return err
	}
	return e.Explain(err, socket)
}

// dial connects to the daemon at socket.
func (e *Env) dial(socket string) (*client.Client, error) {
	return e.dialOptions(socket, client.Options{})
}

// dialOptions is dial with client options.
func (e *Env) dialOptions(socket string, opts client.Options) (*client.Client, error) {
	c, err := client.DialOptions(e.Ctx, socket, opts)
	return c, e.explain(err, socket)
}

// UsageError is a diagnostic's complaint about its flags; the CLI exits
// with status 2 for it, as for any other bad argument.
type UsageError struct{ Err error }

func (e *UsageError) Error() string { return e.Err.Error() }
func (e *UsageError) Unwrap() error { return e.Err }

func usagef(format string, args ...any) error {
	return &UsageError{Err: fmt.Errorf(format, args...)}
}

// HelperCommand is the hidden command under which the diagnostics
// re-execute this program as their helper processes.
const HelperCommand = "diag-helper"

// helpers maps each ROLE of HelperCommand to what it runs.
var helpers = map[string]func(env *Env, config []byte) error{
	"doctor-exporter": doctorExporter,
	"bench-exporter":  benchExporter,
	"demo-worker":     demoWorker,
	"bench-pingpong":  benchPingPong,
}

// RunHelper runs the helper process role with its configuration (JSON),
// as the CLI's hidden command HelperCommand does.
func RunHelper(env *Env, role, config string) error {
	h, ok := helpers[role]
	if !ok {
		return usagef("%s: unknown role %q", HelperCommand, role)
	}
	return h(env, []byte(config))
}

// helper is a running helper process: this program, re-executed.
type helper struct {
	role   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stdout io.ReadCloser
	stderr bytes.Buffer  // read only after cmd.Wait, which ends the copying
	done   chan struct{} // closed when cmd.Wait has returned
	err    error         // of cmd.Wait, once done
}

// startHelper starts this program as helper role with config (marshalled
// to JSON), extra files from descriptor 3 on, and env added to this
// process's environment.
func startHelper(ctx context.Context, role string, config any, extra []*os.File, env ...string) (*helper, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("finding this program to start its %s process: %w", role, err)
	}
	cfg, err := json.Marshal(config)
	if err != nil {
		return nil, err
	}
	h := &helper{role: role, done: make(chan struct{})}
	h.cmd = exec.CommandContext(ctx, exe, HelperCommand, role, string(cfg))
	h.cmd.Env = append(os.Environ(), env...)
	h.cmd.ExtraFiles = extra
	h.cmd.Stderr = &h.stderr
	if h.stdin, err = h.cmd.StdinPipe(); err != nil {
		return nil, err
	}
	if h.stdout, err = h.cmd.StdoutPipe(); err != nil {
		return nil, err
	}
	if err := h.cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting the %s process: %w", role, err)
	}
	return h, nil
}

// wait closes the helper's standard input and waits for it to exit,
// killing it after grace; the error says how it failed, with the last
// line of its standard error.
func (h *helper) wait(grace time.Duration) error {
	h.stdin.Close()
	go func() { h.err = h.cmd.Wait(); close(h.done) }()
	select {
	case <-h.done:
	case <-time.After(grace):
		_ = h.cmd.Process.Kill()
		<-h.done
	}
	if h.err != nil {
		return fmt.Errorf("the %s process failed: %v%s", h.role, h.err, h.why())
	}
	return nil
}

// kill stops the helper at once.
func (h *helper) kill() {
	_ = h.cmd.Process.Kill()
	_ = h.wait(time.Minute)
}

// why is the last line the helper wrote to standard error, as ": line",
// or "" when it wrote none.
func (h *helper) why() string {
	text := strings.TrimSpace(h.stderr.String())
	if text == "" {
		return ""
	}
	return ": " + text[strings.LastIndexByte(text, '\n')+1:]
}

// errNoGPU is what the GPU diagnostics say where no GPU is visible.
var errNoGPU = errors.New("no GPU visible to this process: check CUDA_VISIBLE_DEVICES, then run 'cudaipc doctor'")

// printJSON writes v indented, as every --json output is.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
