package store

import (
	"fmt"
	"os"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// Registrations of any size. One packet carries at most protocol.MaxFiles
// descriptors, and memory of PyTorch's expandable segments has one per
// 20 MiB piece (a 4 GiB tensor: about 205). So a client stages the
// descriptors beyond one packet's with stage_files requests before its
// register, which takes them all (docs/protocol.md, section 6.5); and a
// reader whose get carried the first protocol.MaxFiles asks for the rest
// with files requests, by lease.

// maxStagedPerConn bounds the descriptors one connection may stage: a
// registration of that many pieces is 80 GiB of 20 MiB pieces, and each
// staged descriptor is a descriptor the daemon holds.
const maxStagedPerConn = 4096

// stage keeps files (which it takes) for the session's next register and
// returns how many are staged now.
func (ss *session) stage(files []*os.File) (int, error) {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case ss.closed:
		protocol.CloseFiles(files)
		return 0, errSessionClosed
	case len(ss.staged)+len(files) > maxStagedPerConn:
		n := len(ss.staged)
		protocol.CloseFiles(files)
		ss.unstageLocked()
		return 0, protocol.Errorf(storev1.Error_LIMIT, "stage_files: %d descriptors staged and %d more would pass the %d one connection may stage; the staged ones are dropped", n, len(files), maxStagedPerConn)
	}
	// Staged descriptors are kept by the daemon like registered ones, and
	// charged to the uid the same way (budget.go).
	if err := s.takeFDsLocked(ss.peer.uid, len(files)); err != nil {
		protocol.CloseFiles(files)
		ss.unstageLocked()
		return 0, fmt.Errorf("stage_files: %w; the staged ones are dropped", err)
	}
	ss.staged = append(ss.staged, files...)
	return len(ss.staged), nil
}

// takeStaged hands the staged descriptors to a register.
func (ss *session) takeStaged() []*os.File {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	f := ss.staged
	ss.staged = nil
	s.giveFDsLocked(ss.peer.uid, len(f)) // register charges what it keeps
	return f
}

// unstageLocked closes the staged descriptors (the connection's end).
func (ss *session) unstageLocked() {
	protocol.CloseFiles(ss.staged)
	ss.s.giveFDsLocked(ss.peer.uid, len(ss.staged))
	ss.staged = nil
}

// leaseFiles returns duplicates of the descriptors from, from+1, ... (at
// most protocol.MaxFiles) of the registration lease id holds.
func (ss *session) leaseFiles(id uint64, from int) ([]*os.File, error) {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return nil, errSessionClosed
	}
	l := ss.leases[id]
	var files []*os.File
	name := ""
	switch {
	case l == nil:
	case l.ext != nil:
		files, name = l.ext.files, l.ext.name
	case l.obj.src != nil:
		files, name = l.obj.src.files, l.obj.name
	}
	switch {
	case l == nil:
		return nil, fmt.Errorf("files: lease %d: %w", id, ErrNotFound)
	case len(files) == 0:
		return nil, invalidf("files: lease %d is not of registered VMM memory", id)
	case from >= len(files):
		return nil, invalidf("files: from %d: the registration has %d descriptors", from, len(files))
	}
	src := files[from:min(len(files), from+protocol.MaxFiles)]
	out := make([]*os.File, 0, len(src))
	for _, f := range src {
		d, err := dupFile(f)
		if err != nil {
			protocol.CloseFiles(out)
			return nil, fmt.Errorf("duplicating a descriptor of %q: %w", name, err)
		}
		out = append(out, d)
	}
	return out, nil
}

// stageReply answers a stage_files request. cn.order must not be held.
func (cn *conn) stageReply(id uint64, files []*os.File) {
	n, err := cn.ss.stage(files)
	if err != nil {
		cn.reply("stage_files", protocol.ErrorResponse(id, err), nil)
		return
	}
	cn.reply("stage_files", &storev1.Response{Id: id, Body: &storev1.Response_StageFiles{StageFiles: &storev1.StageFilesResponse{Staged: uint32(n)}}}, nil)
}

// filesReply answers a files request with the descriptors attached.
func (cn *conn) filesReply(id uint64, r *storev1.FilesRequest) {
	files, err := cn.ss.leaseFiles(r.GetLeaseId(), int(r.GetFrom()))
	if err != nil {
		cn.reply("files", protocol.ErrorResponse(id, err), nil)
		return
	}
	defer protocol.CloseFiles(files)
	cn.order.Lock()
	defer cn.order.Unlock()
	cn.s.metrics.request("files", "ok")
	cn.sendLocked(&storev1.Response{Id: id, Body: &storev1.Response_Files{Files: &storev1.FilesResponse{From: r.GetFrom(), Count: uint32(len(files))}}}, files...)
}
