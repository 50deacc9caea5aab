package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
	"github.com/schollz/progressbar/v3"
)

// socketPath is the daemon socket the store commands use: --socket, else
// $CUDAIPC_SOCKET (both filled in by kong), else the per-user default.
func (g *Globals) socketPath() string {
	if g.Socket != "" {
		return g.Socket
	}
	return client.DefaultSocketPath()
}

// dial connects to the store daemon, with an error that says what to do
// when there is none.
func (g *Globals) dial() (*client.Client, error) { return g.dialCtx(g.Context()) }

// dialCtx is dial bounded by ctx (a command's --timeout).
func (g *Globals) dialCtx(ctx context.Context) (*client.Client, error) {
	sock := g.socketPath()
	c, err := client.Dial(ctx, sock)
	if err != nil {
		return nil, explain(err, sock)
	}
	return c, nil
}

// explain turns a client error into one line for a person: what failed,
// why, and what to do next. The result still matches what err matched.
func explain(err error, socket string) error {
	var ce *client.Error
	if !errors.As(err, &ce) {
		return err
	}
	what := ce.Op
	if ce.Name != "" {
		what += fmt.Sprintf(" %q", ce.Name)
	}
	why := func(s string) string { // s, and the daemon's detail when it has one
		if d := detail(ce); d != "" {
			return s + " (" + d + ")"
		}
		return s
	}
	isDial := ce.Op == "dial"
	switch {
	case isDial && errors.Is(err, client.ErrStoreGone):
		return reword(err, "no store daemon at %s%s: start one with 'cudaipc serve', or point --socket or CUDAIPC_SOCKET at a running one", socket, errnoOf(err))
	case isDial && errors.Is(err, client.ErrPermission):
		uid := os.Getuid()
		return reword(err, "the store daemon at %s does not admit uid %d: ask whoever runs it to add '--allow-uid %d' (or --allow-gid) to 'cudaipc serve'", socket, uid, uid)
	case isDial && errors.Is(err, client.ErrTimeout):
		return reword(err, "the store daemon at %s did not answer in time: check that 'cudaipc serve' is running and not stopped or overloaded, then retry", socket)
	case isDial && errors.Is(err, client.ErrVersion):
		return reword(err, "%s: the store daemon at %s speaks another protocol version: run a cudaipc of the daemon's release", why("dial"), socket)
	case errors.Is(err, client.ErrStoreGone):
		return reword(err, "%s: lost the connection to the store daemon at %s: check that 'cudaipc serve' still runs, then retry", what, socket)
	case errors.Is(err, client.ErrUnavailable):
		return reword(err, "%s: %s: retry later; 'cudaipc doctor --cluster ETCD' checks etcd and the nodes", what, why("the cluster cannot serve it now"))
	case errors.Is(err, client.ErrDataLoss):
		return reword(err, "%s: %s: retrying does not help; 'cudaipc doctor --cluster ETCD --cluster-secret FILE' lists the records that do not verify", what, why("a cluster record or the object's bytes do not verify"))
	case errors.Is(err, client.ErrNotFound):
		return reword(err, "%s: no such object: 'cudaipc ls' lists the objects you can read", what)
	case errors.Is(err, client.ErrExists):
		return reword(err, "%s: an object of that name exists: pick another --name, or remove the old one with 'cudaipc rm'", what)
	case errors.Is(err, client.ErrStoreFull):
		return reword(err, "%s: %s: free space with 'cudaipc rm', or restart 'cudaipc serve' with a larger --capacity", what, why("the store is full"))
	case errors.Is(err, client.ErrLimit):
		// The daemon says which limit was hit (connections, objects,
		// leases, descriptors) and what to do about it.
		if d := detail(ce); d != "" {
			return reword(err, "%s: limit reached: %s", what, d)
		}
		return reword(err, "%s: a limit of the store daemon was reached", what)
	case errors.Is(err, cudaipc.ErrOtherPIDNamespace):
		return reword(err, "%s: the store daemon shares GPU memory by legacy CUDA IPC, which cannot reach this process's PID namespace: restart the daemon with 'cudaipc serve --gpu-share fd', or run this command in the daemon's PID namespace", what)
	}
	// The command says which store operation failed; "store " adds nothing.
	return reword(err, "%s", strings.TrimPrefix(err.Error(), "store "))
}

// detail is the daemon's message of ce, without what Error says anyway.
func detail(ce *client.Error) string {
	d := strings.TrimSpace(ce.Message)
	if ce.Err != nil {
		d = strings.TrimSuffix(strings.TrimPrefix(d, ce.Err.Error()), ": "+ce.Err.Error())
	}
	return strings.TrimLeft(d, ": ")
}

// errnoOf is " (connect: <errno>)" for a failed connect, else "".
func errnoOf(err error) string {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return " (connect: " + errno.Error() + ")"
	}
	return ""
}

// reworded is an error with text for a person that still matches (errors.Is,
// errors.As) what it rewords.
type reworded struct {
	text string
	err  error
}

func (r *reworded) Error() string { return r.text }
func (r *reworded) Unwrap() error { return r.err }

func reword(err error, format string, args ...any) error {
	return &reworded{text: fmt.Sprintf(format, args...), err: err}
}

// newProgress returns a byte progress bar on w when w is a terminal, else
// nil (callers use progressAdd, which accepts nil).
func newProgress(w io.Writer, total int64, what string) *progressbar.ProgressBar {
	if !isTerminal(w) || total <= 0 {
		return nil
	}
	return progressbar.NewOptions64(total,
		progressbar.OptionSetWriter(w),
		progressbar.OptionSetDescription(what),
		progressbar.OptionShowBytes(true),
		progressbar.OptionUseIECUnits(true),
		progressbar.OptionSetWidth(30),
		progressbar.OptionThrottle(65*time.Millisecond),
		progressbar.OptionClearOnFinish(),
	)
}

func progressAdd(b *progressbar.ProgressBar, n int) {
	if b != nil {
		_ = b.Add(n)
	}
}

func progressDone(b *progressbar.ProgressBar) {
	if b != nil {
		_ = b.Finish()
	}
}

// copyChunk is how much put and get move between progress updates.
const copyChunk = 4 << 20
