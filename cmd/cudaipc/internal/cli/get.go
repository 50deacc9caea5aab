package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"time"

	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/client"
)

type getCmd struct {
	Name    string        `arg:"" help:"Object to read: NAME for your own, UID:NAME for another user's (shared) object." placeholder:"NAME"`
	Owner   string        `help:"Read only an object of this user (a uid or a user name): a bare NAME then means that user's NAME, and an object of anyone else is refused." placeholder:"USER"`
	Output  string        `short:"o" default:"-" help:"Write the object to FILE; - (the default) writes to standard output." placeholder:"FILE|-"`
	Raw     bool          `help:"Write a bundle's bytes as they are, not as a safetensors file."`
	Tensors []string      `help:"Write only these tensors of a bundle (comma-separated names), as a safetensors file: a daemon of a cluster that does not hold the bundle reads only them from another node." placeholder:"NAME,..."`
	Wait    bool          `help:"When no sealed object NAME exists yet, wait until one is put (and say so on stderr), instead of failing at once; --timeout bounds the wait."`
	Timeout time.Duration `default:"0s" help:"Bound on the whole command: connecting, waiting for NAME to be sealed and writing it; a timeout above 0 waits as --wait does (default 0: no bound)." placeholder:"D"`
}

func (c *getCmd) Help() string {
	return "Writes the bytes of the sealed object NAME. Without --wait or --timeout, a NAME with no sealed object (none, or one still being written) fails at once with 'no such object' (exit 1). " +
		"The lease is held while writing, so the object's memory cannot be reused underneath. " +
		"A bundle (put from safetensors) is written as a safetensors file: byte for byte the file it was put from when that file's tensors were 256-byte aligned, else the same tensors densely packed (--raw writes the bundle's bytes as they are; --tensors only the tensors named)."
}

func (c *getCmd) Run(g *Globals) error {
	if c.Output == "-" && isTerminal(g.stdout) {
		return &ExitError{Code: 2, Err: errors.New("refusing to write binary data to a terminal: use -o FILE or redirect stdout")}
	}
	if c.Raw && len(c.Tensors) > 0 {
		return &ExitError{Code: 2, Err: errors.New("--raw writes a bundle's bytes as they are, --tensors a safetensors file of some tensors: give one of them")}
	}
	ctx := g.Context()
	if c.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.Timeout)
		defer cancel()
	}
	cl, err := g.dialCtx(ctx)
	if errors.Is(err, client.ErrTimeout) && c.Timeout > 0 {
		return fmt.Errorf("the store daemon at %s did not answer within --timeout %s: check that 'cudaipc serve' is running and not stopped (%w)", g.socketPath(), c.Timeout, err)
	}
	if err != nil {
		return err
	}
	defer cl.Close()

	var opts client.GetOptions
	if c.Owner != "" {
		uid, err := lookupUID(c.Owner)
		if err != nil {
			return &ExitError{Code: 2, Err: err}
		}
		opts.RequireOwner, opts.Owner = true, uid
	}
	var subset *bundle.Manifest // the tensors asked for (--tensors)
	get := func() (*client.Lease, error) { return cl.GetWith(ctx, c.Name, opts) }
	if len(c.Tensors) > 0 {
		opts.Tensors = c.Tensors
		get = func() (l *client.Lease, err error) {
			l, subset, err = cl.GetBundle(ctx, c.Name, opts)
			return l, err
		}
	}
	lease, err := get()
	if errors.Is(err, client.ErrNotFound) && (c.Wait || c.Timeout > 0) {
		// Said at once and whether or not stderr is a terminal, so that a
		// name nobody puts (a typo) does not look like a hang.
		until := "until Ctrl-C"
		if c.Timeout > 0 {
			until = "at most --timeout " + c.Timeout.String()
		}
		fmt.Fprintf(g.stderr, "cudaipc: waiting for %q to be sealed, %s ('cudaipc ls' lists what exists)\n", c.Name, until)
		opts.Wait = true
		lease, err = get()
	}
	if errors.Is(err, client.ErrNotFound) && !opts.Wait {
		return reword(err, "get %q: no such object: 'cudaipc ls' lists the objects you can read; --wait waits for it to be put", c.Name)
	}
	if errors.Is(err, client.ErrTimeout) {
		return reword(err, "get %q: not sealed within %s: check the name with 'cudaipc ls', or wait longer with --timeout", c.Name, c.Timeout)
	}
	if err != nil {
		return explain(err, g.socketPath())
	}
	defer lease.Release()

	write := writeLease
	switch {
	case subset != nil:
		write = func(ctx context.Context, w io.Writer, l *client.Lease, progress func(int)) error {
			return writeTensors(ctx, w, l, subset, progress)
		}
	case lease.Info().ManifestSize > 0 && !c.Raw:
		write = writeBundle
	}
	if c.Output == "-" {
		return write(ctx, g.stdout, lease, nil)
	}
	// Write next to the target and rename, so that FILE is never left half
	// written.
	tmp, err := os.CreateTemp(filepath.Dir(c.Output), "."+filepath.Base(c.Output)+".*")
	if err != nil {
		return fmt.Errorf("get: %w: -o names a file in a directory you can write", err)
	}
	defer os.Remove(tmp.Name())
	bar := newProgress(g.stderr, lease.Size(), "get "+c.Name)
	out := &countingWriter{w: tmp} // a bundle's safetensors file is not the lease's size
	err = write(ctx, out, lease, func(n int) { progressAdd(bar, n) })
	progressDone(bar)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("writing %s: %w", c.Output, err)
	}
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), c.Output); err != nil {
		return err
	}
	in := lease.Info()
	fmt.Fprintf(g.stdout, "wrote %s: %q, %d bytes, owner uid %d\n", c.Output, in.Name, out.n, in.OwnerUID)
	return nil
}

// lookupUID reads --owner: a uid, or a user name of this machine.
func lookupUID(s string) (uint32, error) {
	if n, err := strconv.ParseUint(s, 10, 32); err == nil {
		return uint32(n), nil
	}
	u, err := user.Lookup(s)
	if err != nil {
		return 0, fmt.Errorf("--owner %q: not a uid, and no such user: %w", s, err)
	}
	n, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return 0, fmt.Errorf("--owner %q: uid %q is not a number", s, u.Uid)
	}
	return uint32(n), nil
}

// writeLease writes a leased object's bytes to w: a host object straight
// from its mapping, a GPU object through ReadAt into a host buffer, one
// chunk at a time, stopping between chunks when ctx ends.
func writeLease(ctx context.Context, w io.Writer, l *client.Lease, progress func(int)) error {
	if b := l.Bytes(); b != nil || l.Size() == 0 {
		return writeAll(ctx, w, b, progress)
	}
	buf := make([]byte, min(int64(copyChunk), l.Size()))
	for off := int64(0); off < l.Size(); {
		n, err := l.ReadAt(buf[:min(int64(len(buf)), l.Size()-off)], off)
		if err != nil && !(err == io.EOF && off+int64(n) == l.Size()) {
			return fmt.Errorf("reading %q from the GPU: %w", l.Info().Name, err)
		}
		if err := writeAll(ctx, w, buf[:n], progress); err != nil {
			return err
		}
		off += int64(n)
	}
	return nil
}

func writeAll(ctx context.Context, w io.Writer, b []byte, progress func(int)) error {
	for off := 0; off < len(b); {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("stopped after %d of %d bytes: %w", off, len(b), context.Cause(ctx))
		}
		end := min(off+copyChunk, len(b))
		n, err := w.Write(b[off:end])
		if progress != nil {
			progress(n)
		}
		if err != nil {
			return err
		}
		off += n
	}
	return nil
}

// countingWriter counts the bytes written through it.
type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(b []byte) (int, error) {
	n, err := c.w.Write(b)
	c.n += int64(n)
	return n, err
}
