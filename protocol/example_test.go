package protocol_test

import (
	"errors"
	"fmt"
	"net"
	"os"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
	"golang.org/x/sys/unix"
)

// conns returns two connected Conns over a SOCK_SEQPACKET socketpair.
func conns() (*protocol.Conn, *protocol.Conn) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		panic(err)
	}
	var cs [2]*protocol.Conn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "sock")
		nc, err := net.FileConn(f)
		f.Close()
		if err != nil {
			panic(err)
		}
		cs[i] = protocol.NewConn(nc.(*net.UnixConn))
	}
	return cs[0], cs[1]
}

// A server hands a client a writable placement with the arena's memfd
// attached; the client maps the arena and finds its object at the offset.
func ExampleConn() {
	server, client := conns()
	defer server.Close()
	defer client.Close()

	// Server: an arena holding an object at offset 256.
	fd, _ := unix.MemfdCreate("arena", unix.MFD_CLOEXEC)
	arena := os.NewFile(uintptr(fd), "arena")
	defer arena.Close()
	arena.Truncate(1 << 20)
	arena.WriteAt([]byte("written by the server"), 256)
	resp := &storev1.Response{Id: 2, Body: &storev1.Response_Create{Create: &storev1.CreateResponse{
		Placement: &storev1.Placement{Kind: storev1.Placement_HOST, ArenaId: 1, Device: "host", Offset: 256, Size: 21,
			ArenaSize: 1 << 20, Writable: true, FdAttached: true}}}}
	if err := server.Send(resp, arena); err != nil {
		fmt.Println(err)
		return
	}

	// Client: receive, validate, map the whole arena, slice the object.
	var got storev1.Response
	files, err := client.Recv(&got)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer protocol.CloseFiles(files)
	if err := protocol.ValidateResponse(&got, len(files)); err != nil {
		fmt.Println(err)
		return
	}
	p := got.GetCreate().GetPlacement()
	mem, err := unix.Mmap(int(files[0].Fd()), 0, int(p.GetArenaSize()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer unix.Munmap(mem)
	fmt.Printf("%s\n", mem[p.GetOffset():p.GetOffset()+p.GetSize()])
	// Output: written by the server
}

// Errors cross the wire as codes and come back as errors that match the
// package's sentinels.
func ExampleErrorResponse() {
	// Server side.
	err := fmt.Errorf("seal %q: %w", "frame-0", protocol.ErrNotFound)
	resp := protocol.ErrorResponse(3, err)
	fmt.Println(resp.GetError().GetCode(), resp.GetError().GetMessage())

	// Client side.
	cerr := protocol.ResponseError(resp)
	fmt.Println(cerr)
	fmt.Println(errors.Is(cerr, protocol.ErrNotFound))
	// Output:
	// NOT_FOUND seal "frame-0"
	// not found: seal "frame-0"
	// true
}
