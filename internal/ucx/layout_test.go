package ucx

import (
	"testing"
	"unsafe"
)

// The offsets below are read from ucp.h and ucp_def.h of UCX v1.13.1 and
// v1.16.0 (LP64), where they are the same; only ucp_mem_map_params_t
// differs, by a field at its end (exported_memh_buffer, 1.16).
func TestLayouts(t *testing.T) {
	type field struct {
		name      string
		got, want uintptr
	}
	check := func(strct string, size, want uintptr, fields []field) {
		t.Helper()
		for _, f := range fields {
			if f.got != f.want {
				t.Errorf("%s.%s at %d, the C struct has it at %d", strct, f.name, f.got, f.want)
			}
		}
		if size-unsafe.Sizeof(slack{}) != want {
			t.Errorf("%s is %d bytes before its slack, the C struct %d", strct, size-unsafe.Sizeof(slack{}), want)
		}
	}
	var p Params
	check("ucp_params_t", unsafe.Sizeof(p), 80, []field{
		{"field_mask", unsafe.Offsetof(p.FieldMask), 0},
		{"features", unsafe.Offsetof(p.Features), 8},
		{"request_size", unsafe.Offsetof(p.RequestSize), 16},
		{"request_init", unsafe.Offsetof(p.RequestInit), 24},
		{"request_cleanup", unsafe.Offsetof(p.RequestCleanup), 32},
		{"tag_sender_mask", unsafe.Offsetof(p.TagSenderMask), 40},
		{"mt_workers_shared", unsafe.Offsetof(p.MtWorkersShared), 48},
		{"estimated_num_eps", unsafe.Offsetof(p.EstimatedNumEps), 56},
		{"estimated_num_ppn", unsafe.Offsetof(p.EstimatedNumPpn), 64},
		{"name", unsafe.Offsetof(p.Name), 72},
	})
	var ca ContextAttr
	check("ucp_context_attr_t", unsafe.Sizeof(ca), 64, []field{
		{"request_size", unsafe.Offsetof(ca.RequestSize), 8},
		{"thread_mode", unsafe.Offsetof(ca.ThreadMode), 16},
		{"memory_types", unsafe.Offsetof(ca.MemoryTypes), 24},
		{"name", unsafe.Offsetof(ca.Name), 32},
	})
	var wp WorkerParams
	check("ucp_worker_params_t", unsafe.Sizeof(wp), 200, []field{
		{"thread_mode", unsafe.Offsetof(wp.ThreadMode), 8},
		{"cpu_mask", unsafe.Offsetof(wp.CPUMask), 16},
		{"events", unsafe.Offsetof(wp.Events), 144},
		{"user_data", unsafe.Offsetof(wp.UserData), 152},
		{"event_fd", unsafe.Offsetof(wp.EventFd), 160},
		{"flags", unsafe.Offsetof(wp.Flags), 168},
		{"name", unsafe.Offsetof(wp.Name), 176},
		{"am_alignment", unsafe.Offsetof(wp.AmAlignment), 184},
		{"client_id", unsafe.Offsetof(wp.ClientID), 192},
	})
	var wa WorkerAttr
	check("ucp_worker_attr_t", unsafe.Sizeof(wa), 80, []field{
		{"thread_mode", unsafe.Offsetof(wa.ThreadMode), 8},
		{"address_flags", unsafe.Offsetof(wa.AddressFlags), 12},
		{"address", unsafe.Offsetof(wa.Address), 16},
		{"address_length", unsafe.Offsetof(wa.AddressLength), 24},
		{"max_am_header", unsafe.Offsetof(wa.MaxAmHeader), 32},
		{"name", unsafe.Offsetof(wa.Name), 40},
		{"max_debug_string", unsafe.Offsetof(wa.MaxDebugString), 72},
	})
	var ep EpParams
	check("ucp_ep_params_t", unsafe.Sizeof(ep), 104, []field{
		{"address", unsafe.Offsetof(ep.Address), 8},
		{"err_mode", unsafe.Offsetof(ep.ErrMode), 16},
		{"err_handler.cb", unsafe.Offsetof(ep.ErrHandlerCb), 24},
		{"err_handler.arg", unsafe.Offsetof(ep.ErrHandlerArg), 32},
		{"user_data", unsafe.Offsetof(ep.UserData), 40},
		{"flags", unsafe.Offsetof(ep.Flags), 48},
		{"sockaddr.addr", unsafe.Offsetof(ep.SockaddrAddr), 56},
		{"sockaddr.addrlen", unsafe.Offsetof(ep.SockaddrLen), 64},
		{"conn_request", unsafe.Offsetof(ep.ConnRequest), 72},
		{"name", unsafe.Offsetof(ep.Name), 80},
		{"local_sockaddr.addr", unsafe.Offsetof(ep.LocalSockaddrAddr), 88},
		{"local_sockaddr.addrlen", unsafe.Offsetof(ep.LocalSockaddrLen), 96},
	})
	var mm MemMapParams
	check("ucp_mem_map_params_t (1.16)", unsafe.Sizeof(mm), 48, []field{
		{"address", unsafe.Offsetof(mm.Address), 8},
		{"length", unsafe.Offsetof(mm.Length), 16},
		{"flags", unsafe.Offsetof(mm.Flags), 24},
		{"prot", unsafe.Offsetof(mm.Prot), 28},
		{"memory_type", unsafe.Offsetof(mm.MemoryType), 32},
		{"exported_memh_buffer", unsafe.Offsetof(mm.ExportedMemhBuffer), 40},
	})
	var rp RequestParam
	check("ucp_request_param_t", unsafe.Sizeof(rp), 72, []field{
		{"flags", unsafe.Offsetof(rp.Flags), 4},
		{"request", unsafe.Offsetof(rp.Request), 8},
		{"cb", unsafe.Offsetof(rp.Cb), 16},
		{"datatype", unsafe.Offsetof(rp.Datatype), 24},
		{"user_data", unsafe.Offsetof(rp.UserData), 32},
		{"reply_buffer", unsafe.Offsetof(rp.ReplyBuffer), 40},
		{"memory_type", unsafe.Offsetof(rp.MemoryType), 48},
		{"recv_info", unsafe.Offsetof(rp.RecvInfo), 56},
		{"memh", unsafe.Offsetof(rp.Memh), 64},
	})
	var ti TagRecvInfo
	if unsafe.Sizeof(ti) != 16 || unsafe.Offsetof(ti.Length) != 8 {
		t.Errorf("ucp_tag_recv_info_t is {sender_tag at 0, length at 8} in 16 bytes; TagRecvInfo has length at %d in %d", unsafe.Offsetof(ti.Length), unsafe.Sizeof(ti))
	}
}

func TestStatusPtr(t *testing.T) {
	for _, c := range []struct {
		r      uintptr
		req    Request
		status Status
	}{
		{0, 0, OK},
		{0x7f0000001000, 0x7f0000001000, OK},
		{^uintptr(0), 0, ErrNoMessage},                      // -1
		{^uintptr(0) - 15, 0, ErrCanceled},                  // -16
		{^uintptr(0) - 79, 0, ErrEndpointTimeout},           // -80
		{^uintptr(0) - 99, 0, ErrLast},                      // -100
		{^uintptr(0) - 100, Request(^uintptr(0) - 100), OK}, // below the error range: a pointer
	} {
		req, err := statusPtr("f", c.r)
		var got Status
		if e, ok := err.(*Error); ok {
			got = e.Status
		}
		if req != c.req || got != c.status {
			t.Errorf("statusPtr(%#x) = %#x, %v; want %#x, %v", c.r, req, err, c.req, c.status)
		}
	}
}
