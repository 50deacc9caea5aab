// Package cli implements the cudaipc command line. main calls Run; every
// command writes to the writers it is given so tests can run it in-process.
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"reflect"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/alecthomas/kong"
	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cmd/cudaipc/internal/diag"
)

// Globals are the flags every command sees, plus the writers and context the
// command runs with.
type Globals struct {
	Socket   string `help:"Path of the store daemon's socket (default: $CUDAIPC_SOCKET, else a per-user path; see 'cudaipc serve --help')." env:"CUDAIPC_SOCKET" placeholder:"PATH"`
	LogLevel string `help:"Log level: debug, info, warn, error." default:"info" enum:"debug,info,warn,error" name:"log-level"`

	ctx    context.Context
	stdin  io.Reader
	stdout io.Writer
	stderr io.Writer
	log    *slog.Logger
}

// Context returns the context the command runs under: cancelled on SIGINT
// or SIGTERM.
func (g *Globals) Context() context.Context { return g.ctx }

// cliRoot is the command tree. Each command is a struct with a Run method,
// in a file of its own; the diagnostics (doctor, demo, bench) live in
// package diag and run with a *diag.Env.
type cliRoot struct {
	Globals
	Version kong.VersionFlag `help:"Print the version and exit."`

	Info   InfoCmd        `cmd:"" help:"Show the driver, each GPU and the peer-access matrix."`
	Doctor diag.DoctorCmd `cmd:"" help:"Check that this machine can share GPU memory, and say what to fix."`
	Dump   DumpCmd        `cmd:"" help:"Write the bytes of a region exported by any program (Go, PyTorch, CuPy, C) to a file or stdout."`

	Serve serveCmd `cmd:"" help:"Run the object store daemon."`
	Put   putCmd   `cmd:"" help:"Store a file as a sealed object."`
	Get   getCmd   `cmd:"" help:"Write an object's bytes to a file or standard output."`
	Ls    lsCmd    `cmd:"" help:"List objects in the store."`
	Stat  statCmd  `cmd:"" help:"Describe one object."`
	Rm    rmCmd    `cmd:"" help:"Remove objects from the store."`

	Demo  diag.DemoCmd `cmd:"" help:"Share objects between two processes through an embedded store, check every byte, and report how fast."`
	Bench benchCmd     `cmd:"" help:"Measure (bench ipc: GPU sharing; bench store: the object store; bench put: a large GPU put; bench cluster: remote gets)."`

	DiagHelper diagHelperCmd `cmd:"" name:"diag-helper" hidden:"" help:"A helper process of doctor, demo or bench (see package diag)."`
}

// benchCmd groups the measurements.
type benchCmd struct {
	IPC     diag.BenchIPCCmd     `cmd:"" name:"ipc" help:"Measure GPU sharing between processes against C, the hardware and host staging."`
	Store   diag.BenchStoreCmd   `cmd:"" help:"Measure get+release round trips against the object store."`
	Put     diag.BenchPutCmd     `cmd:"" help:"Measure a put of a large GPU object against an in-process device-to-device copy."`
	Cluster diag.BenchClusterCmd `cmd:"" help:"Measure gets of objects another daemon holds against ucx_perftest on the same link."`
}

// diagHelperCmd is the one way the diagnostics re-execute this program.
type diagHelperCmd struct {
	Role   string `arg:""`
	Config string `arg:""`
}

func (c *diagHelperCmd) Run(e *diag.Env) error { return diag.RunHelper(e, c.Role, c.Config) }

// ExitError carries an exit code other than 1.
type ExitError struct {
	Code int
	Err  error
}

func (e *ExitError) Error() string { return e.Err.Error() }
func (e *ExitError) Unwrap() error { return e.Err }

// Exit codes of the command line besides 0 (success), 1 (any other
// failure) and 2 (bad arguments): one per class of store failure a script
// may act on differently. docs/protocol.md tabulates them with the
// protocol's codes.
const (
	// ExitNotFound: no such object (in a cluster: no live node holds it).
	ExitNotFound = 3
	// ExitUnavailable: the cluster directory or every holder of the object
	// is unreachable now; retry later.
	ExitUnavailable = 4
	// ExitDataLoss: a cluster record or the object's bytes do not verify;
	// retrying does not help.
	ExitDataLoss = 5
	// ExitTimeout: the object was not readable before --timeout.
	ExitTimeout = 6
	// ExitStoreFull: not enough memory for the object, even after eviction.
	ExitStoreFull = 7
)

// exitClasses maps store sentinels to exit codes; an error of several
// classes (rm of several names) exits with the first that it matches.
var exitClasses = []struct {
	err  error
	code int
}{
	{client.ErrDataLoss, ExitDataLoss},
	{client.ErrUnavailable, ExitUnavailable},
	{client.ErrStoreFull, ExitStoreFull},
	{client.ErrTimeout, ExitTimeout},
	{client.ErrNotFound, ExitNotFound},
}

// ExitCode returns the process exit code for an error returned by Run: 2
// for bad arguments, the code of its class for a store failure of one of
// exitClasses (ExitNotFound, ExitUnavailable, ...), else 1, unless an
// *ExitError says otherwise.
func ExitCode(err error) int {
	var ee *ExitError
	if errors.As(err, &ee) {
		return ee.Code
	}
	var ue *diag.UsageError
	if errors.As(err, &ue) {
		return 2
	}
	for _, c := range exitClasses {
		if errors.Is(err, c.err) {
			return c.code
		}
	}
	return 1
}

// Message is the line main prints for an error Run returned: "cudaipc: "
// and the error, on one line, naming the program once (errors of package
// cudaipc begin with "cudaipc: " too, also when the CLI wraps them).
func Message(err error) string {
	s := strings.TrimSpace(err.Error())
	s = strings.ReplaceAll(s, "\n", "; ")
	s = strings.ReplaceAll(s, ": cudaipc: ", ": ")
	return "cudaipc: " + strings.TrimPrefix(s, "cudaipc: ")
}

// Run parses args and runs the chosen command. ctx is cancelled when the
// process is asked to stop.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return runIO(ctx, args, os.Stdin, stdout, stderr)
}

// runIO is Run with standard input as a parameter, for tests.
func runIO(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	var root cliRoot
	exit := -1
	parser, err := kong.New(&root,
		kong.Name("cudaipc"),
		kong.Description("Zero-copy GPU memory sharing between processes on one machine.\n\n"+
			"Exit status: 0 success; 1 failure; 2 bad arguments; 3 not found (in a cluster: no live node holds it); "+
			"4 unavailable: etcd or every holder unreachable, retry later; 5 a cluster record or the bytes do not verify; "+
			"6 timed out; 7 store full."),
		kong.Writers(stdout, stderr),
		kong.Exit(func(code int) { exit = code; panic(exitPanic{}) }),
		kong.UsageOnError(),
		kong.Vars{"version": version()},
	)
	if err != nil {
		return err
	}
	// A bare "cudaipc" and "cudaipc help [COMMAND...]" print the usage, as
	// --help does.
	if len(args) == 0 {
		args = []string{"--help"}
	} else if args[0] == "help" {
		args = append(slices.Clone(args[1:]), "--help")
	}
	// kong turns bytes that are not UTF-8 into U+FFFD; such arguments go
	// through it masked and come back as given, so that a bad object name
	// reaches the client and gets its error instead of becoming another
	// name.
	masked, raw := maskInvalidUTF8(args)
	var kctx *kong.Context
	func() {
		defer func() {
			if r := recover(); r != nil {
				if _, ok := r.(exitPanic); !ok {
					panic(r)
				}
			}
		}()
		kctx, err = parser.Parse(masked)
	}()
	if exit >= 0 { // --help or a parse error already reported by kong
		if exit == 0 {
			return nil
		}
		return &ExitError{Code: exit, Err: errors.New("invalid arguments")}
	}
	if err != nil {
		help := "cudaipc help"
		var pe *kong.ParseError
		if errors.As(err, &pe) && pe.Context != nil && pe.Context.Selected() != nil {
			help = "cudaipc help " + strings.TrimPrefix(pe.Context.Selected().FullPath(), "cudaipc ")
		}
		return &ExitError{Code: 2, Err: fmt.Errorf("%w (see '%s')", err, help)}
	}
	unmaskStrings(reflect.ValueOf(&root).Elem(), raw)
	root.ctx = ctx
	root.stdin = stdin
	root.stdout = stdout
	root.stderr = stderr
	root.log = newLogger(stderr, root.LogLevel)
	return kctx.Run(&root.Globals, root.env())
}

// env is what the diagnostics run with.
func (g *Globals) env() *diag.Env {
	return &diag.Env{
		Ctx: g.ctx, Stdin: g.stdin, Stdout: g.stdout, Stderr: g.stderr,
		Log: g.log, LogLevel: g.LogLevel,
		Socket: g.Socket, DefaultSocket: client.DefaultSocketPath(),
		Explain: explain,
	}
}

type exitPanic struct{}

func newLogger(w io.Writer, level string) *slog.Logger {
	var l slog.Level
	_ = l.UnmarshalText([]byte(level))
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l}))
}

// isTerminal reports whether w is a terminal: for progress bars, and to
// refuse writing binary data to one. Other character devices (/dev/null)
// are not terminals.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// version names the module version this binary was built from (a release
// tag, or the VCS revision for a build from a checkout).
func version() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "cudaipc (unknown version)"
	}
	v := bi.Main.Version
	for _, s := range bi.Settings {
		if s.Key == "vcs.revision" && (v == "" || v == "(devel)") {
			v = s.Value
			if len(v) > 12 {
				v = v[:12]
			}
		}
	}
	if v == "" {
		v = "(devel)"
	}
	return "cudaipc " + v + " (" + bi.GoVersion + ")"
}

// maskInvalidUTF8 replaces each argument that is not valid UTF-8 by a
// placeholder no one types, and returns the placeholders' originals.
func maskInvalidUTF8(args []string) ([]string, map[string]string) {
	var raw map[string]string
	out := args
	for i, a := range args {
		if utf8.ValidString(a) {
			continue
		}
		if raw == nil {
			raw = make(map[string]string)
			out = slices.Clone(args)
		}
		k := "\x00cudaipc-arg-" + strconv.Itoa(i) + "\x00"
		if flag, value, ok := strings.Cut(a, "="); ok && strings.HasPrefix(a, "-") && utf8.ValidString(flag) {
			raw[k], out[i] = value, flag+"="+k // --name=VALUE
		} else {
			raw[k], out[i] = a, k
		}
	}
	return out, raw
}

// unmaskStrings puts the originals of maskInvalidUTF8 back into the parsed
// string fields of v.
func unmaskStrings(v reflect.Value, raw map[string]string) {
	if len(raw) == 0 {
		return
	}
	switch v.Kind() {
	case reflect.Struct:
		for i := range v.NumField() {
			if v.Type().Field(i).IsExported() {
				unmaskStrings(v.Field(i), raw)
			}
		}
	case reflect.Slice:
		for i := range v.Len() {
			unmaskStrings(v.Index(i), raw)
		}
	case reflect.String:
		s := v.String()
		for k, orig := range raw {
			s = strings.ReplaceAll(s, k, orig)
		}
		if v.CanSet() {
			v.SetString(s)
		}
	}
}
